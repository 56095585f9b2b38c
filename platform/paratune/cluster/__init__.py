"""Ray: launching workers, reused worker groups, the trial's driver, profile timing."""

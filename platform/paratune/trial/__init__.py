"""One trial on its workers: the measured step, a user's loop, placement, precision, its records."""

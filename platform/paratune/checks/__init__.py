"""Whether a plan can run: the model family's layout rules and the one refusal path."""

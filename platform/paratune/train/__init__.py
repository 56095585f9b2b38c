"""The full training run of a winner, and the trained model as a Hugging Face folder."""

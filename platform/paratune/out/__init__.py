"""What paratune hands back: console tables, progress, MLflow, the winner's exports."""

"""The training loop: set-up, iterations, evaluation, metrics."""

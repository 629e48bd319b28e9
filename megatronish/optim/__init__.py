"""Optimizer, gradient clipping and the LR / weight-decay schedule (``lr_schedule``)."""

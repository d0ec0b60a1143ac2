"""Trainer-callback helpers: early stopping on a monitored metric."""


class EarlyStopping:
    """Stop when the monitored value has not improved for ``patience`` checks (on the value given)."""

    def __init__(self, patience: int = 1, min_delta: float = 0.0) -> None:
        self.patience, self.min_delta = patience, min_delta
        self.best = float("inf")
        self.bad = 0

    def should_stop(self, value: float) -> bool:
        if value < self.best - self.min_delta:
            self.best, self.bad = value, 0
        else:
            self.bad += 1
        return self.bad >= self.patience

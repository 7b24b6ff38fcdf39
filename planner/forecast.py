"""Forecasts of the next interval's request rate, prompt and output lengths.

The throughput loop observes each quantity once per interval and asks for the next
interval's value. Three forecasters, as Dynamo's planner offers:

* ``constant``: the next is the last observed.
* ``kalman``: a local linear trend (level and slope) filtered by a Kalman filter; follows
  a ramp without lagging a full interval behind it.
* ``arima``: ARIMA(p, 1, 0): an autoregression of order ``p`` on the differences, fitted
  by least squares over the history; ``constant`` until the history is long enough.

No forecast goes below zero.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import numpy as np


class Forecaster(Protocol):
    def observe(self, value: float) -> None: ...

    def predict(self) -> float | None: ...


class Constant:
    def __init__(self) -> None:
        self.last: float | None = None

    def observe(self, value: float) -> None:
        self.last = value

    def predict(self) -> float | None:
        return self.last


class Kalman:
    """Local linear trend: state (level, slope); ``q`` the process noise relative to the
    observation noise ``r`` (larger follows changes faster)."""

    def __init__(self, q: float = 0.1, r: float = 1.0) -> None:
        self.x: np.ndarray | None = None
        self.p = np.eye(2) * 1e3
        self.f = np.array([[1.0, 1.0], [0.0, 1.0]])
        self.h = np.array([[1.0, 0.0]])
        self.q_rel, self.r_rel = q, r

    def observe(self, value: float) -> None:
        if self.x is None:
            self.x = np.array([value, 0.0])
            return
        scale = max(abs(value), abs(float(self.x[0])), 1e-9) ** 2  # noise in the value's units
        q, r = np.eye(2) * self.q_rel * scale, self.r_rel * scale
        x = self.f @ self.x
        p = self.f @ self.p @ self.f.T + q
        y = value - float((self.h @ x)[0])
        s = float((self.h @ p @ self.h.T)[0, 0]) + r
        k = (p @ self.h.T)[:, 0] / s
        self.x = x + k * y
        self.p = (np.eye(2) - np.outer(k, self.h[0])) @ p

    def predict(self) -> float | None:
        if self.x is None:
            return None
        return max(0.0, float(self.x[0] + self.x[1]))


class Arima:
    """ARIMA(p, 1, 0) by least squares on the last ``history`` observations."""

    def __init__(self, p: int = 2, history: int = 64) -> None:
        self.p = p
        self.values: deque[float] = deque(maxlen=history)

    def observe(self, value: float) -> None:
        self.values.append(value)

    def predict(self) -> float | None:
        if not self.values:
            return None
        v = np.asarray(self.values, dtype=np.float64)
        d = np.diff(v)
        if len(d) < 2 * self.p + 2:
            return float(v[-1])
        rows = np.column_stack([d[self.p - i - 1 : len(d) - i - 1] for i in range(self.p)])
        x = np.column_stack([np.ones(len(rows)), rows])
        beta, *_ = np.linalg.lstsq(x, d[self.p :], rcond=None)
        nxt = float(beta[0] + beta[1:] @ d[::-1][: self.p])
        return max(0.0, float(v[-1]) + nxt)


FORECASTERS = {"constant": Constant, "kalman": Kalman, "arima": Arima}


def make_forecaster(kind: str) -> Forecaster:
    try:
        return FORECASTERS[kind]()
    except KeyError:
        raise ValueError(f"unknown forecaster {kind!r}: one of {', '.join(FORECASTERS)}") from None

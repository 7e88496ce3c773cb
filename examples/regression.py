"""Calibrated intervals from a frozen transformer regressor with attnuq.SARegressor.

Trains a small transformer on synthetic data (about 10 s on one CPU core), then fits the
recommended stochastic-attention recipe on two held-out parts, prints the coverage of its
intervals on fresh data and, beside them, plain split conformal's (the baseline SA must beat).
The README shows this file without its docstring (tests/test_readme.py checks that they agree).
Run: ``python examples/regression.py``.
"""

import math

import torch
from torch import nn

import attnuq

torch.manual_seed(0)


def make_data(n):
    """Sequences of 8 tokens with 4 features; the target is the mean of feature 1 over the
    tokens whose feature 0 is positive, with noise that grows with feature 2 of token 0."""
    x = torch.randn(n, 8, 4)
    keep = (x[..., 0] > 0).float()
    y = (x[..., 1] * keep).sum(1) / keep.sum(1).clamp_min(1.0)
    noise = 0.1 + 0.3 * x[:, 0, 2].abs()
    return x, y + noise * torch.randn(n)


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 1)

    def forward(self, x):  # (B, 8, 4) -> (B,)
        return self.head(self.encoder(self.embed(x)).mean(1)).squeeze(-1)


# 1. train a model as usual (any trained transformer works; attnuq never changes its weights)
x_train, y_train = make_data(2000)
model = Regressor()
opt = torch.optim.Adam(model.parameters(), lr=3e-3)
for _ in range(300):
    idx = torch.randint(0, len(x_train), (128,))
    loss = nn.functional.mse_loss(model(x_train[idx]), y_train[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
model.eval()

# 2. two held-out parts: val_data chooses nu and the form, cal_data calibrates the intervals
x_val, y_val = make_data(500)
x_cal, y_cal = make_data(1000)
val_data = [(x_val[i:i + 250], y_val[i:i + 250]) for i in range(0, 500, 250)]  # (inputs, targets)
cal_data = [(x_cal[i:i + 250], y_cal[i:i + 250]) for i in range(0, 1000, 250)]

sa = attnuq.SARegressor(model, progress=False).fit(val_data, cal_data)
d = sa.diagnostics  # also saved in the JSON by sa.save(path)
print(f"nu = {d['nu']} (at an edge of nu_range: {d['nu_at_edge']}) | form: {d['form']} "
      f"(beta = {d['floor_beta_units']:g} x the residual RMS; 0: SA alone, inf: constant "
      f"width) | validation Spearman(spread, |error|) = "
      f"{d['spearman_spread_abs_error']:.2f}")

# 3. predict on fresh data: intervals at any level
x_test, y_test = make_data(2000)
pred = sa.predict(x_test)  # pred.mean, pred.std, pred.interval(level), pred.samples (S, B)
for level in (0.5, 0.8, 0.9, 0.95):
    lower, upper = pred.interval(level)
    covered = ((lower <= y_test) & (y_test <= upper)).float().mean().item()
    print(f"level {level:.2f}: coverage {covered:.3f}, mean width {(upper - lower).mean():.3f}")
print(f"CRPS {pred.crps(y_test).item():.4f}")

# 4. the baseline SA must beat: plain split conformal on the frozen model's residuals
with torch.no_grad():
    r = (model(x_cal) - y_cal).abs().sort().values  # calibration scores |y - f|
    f_test = model(x_test)
q = r[math.ceil(0.9 * (len(r) + 1)) - 1]  # the ceil((n + 1) 0.9)-th smallest score
covered = ((f_test - y_test).abs() <= q).float().mean().item()
print(f"plain conformal, level 0.90: coverage {covered:.3f}, width {2 * q:.3f}")

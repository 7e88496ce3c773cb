"""attnuq.models"""

from attnuq.models.levy_forecaster import (
    ForecastOutput,
    LevyForecaster,
    SoftmaxForecaster,
    fit_temperature,
)

__all__ = ["ForecastOutput", "LevyForecaster", "SoftmaxForecaster", "fit_temperature"]

"""Offline: calibrate and quantize a target to INT8."""

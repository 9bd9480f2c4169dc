"""Offline: checkpoint -> draft -> graph -> engine."""

"""Thin adapters from training frameworks to the pace_strategy core."""

"""Verification: capture, compare, logit parity, localization, reports."""

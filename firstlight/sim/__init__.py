"""Performance model and serving simulator."""

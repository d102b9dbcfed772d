"""dtrain."""

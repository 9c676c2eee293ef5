"""The CPU replica of model and optimizer state, its persistence and restore."""

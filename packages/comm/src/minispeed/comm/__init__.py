"""minispeed.comm (in progress)."""

"""minispeed.zero (in progress)."""

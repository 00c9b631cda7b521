"""Small verifiable tasks with their own data, reward and warm start (nothing is downloaded)."""

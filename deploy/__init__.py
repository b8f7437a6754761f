"""groundflow deploy."""

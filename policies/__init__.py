"""groundflow policies."""

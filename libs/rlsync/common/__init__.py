"""Messages shared by several services (generation requests and chunks)."""

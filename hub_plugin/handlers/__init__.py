"""REST handlers, one module per resource, each ending in its ``routes`` list."""

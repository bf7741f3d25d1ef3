"""One router per resource; ``api.main`` includes them all."""

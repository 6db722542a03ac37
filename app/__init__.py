"""The application edge: the composition root, the command line, the HTTP metrics."""

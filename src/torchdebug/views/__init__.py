"""Read-only consumers of a run folder: reports (text/JSON/HTML/PNG), the dashboard server, TensorBoard."""

"""Read-only consumers of a run folder: reports (text/JSON/HTML/PNG) and the dashboard server (trackers: ``torchdebug.sinks``)."""

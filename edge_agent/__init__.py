"""EdgeSplit edge agent: connects to the broker, trains its part locally, streams
what its method sends, and measures what that cost on this device."""

__version__ = "0.1.0"

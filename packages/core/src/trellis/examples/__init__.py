"""Examples that run without downloads: tiny models, the arithmetic task, the demo."""

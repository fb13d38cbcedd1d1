"""posenc lab: tiny-model length-generalization experiments with posenc's own decoder and schemes."""

"""What operators see: metrics, health endpoints, logs, traces, endpoint health and operator events."""

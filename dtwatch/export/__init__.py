"""What leaves the watchdog: Prometheus metrics, OTLP spans and metrics, NVML readings, webhooks."""

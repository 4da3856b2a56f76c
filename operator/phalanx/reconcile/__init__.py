"""Pure planning: spec + observed children + now -> desired objects, changes and the next status.

Nothing here does I/O, reads the clock or imports kopf, a Kubernetes client or
prometheus_client (an import-linter contract enforces it).
"""

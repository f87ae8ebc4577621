"""Observing: reports of what the cache holds. Prometheus collector (`metrics`), the HTTP
endpoints (`server`), plots of a plan and of a run's timeline, and the terminal table. Reads the
ledger and the plan; nothing below imports it."""

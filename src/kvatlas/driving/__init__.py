"""Driving: workloads that exercise a real cache. Request streams and traces (`workload`), the
scheduler-like simulator (`sim`) and the writer that stores synthetic rows through the data path
(`simwrite`)."""

"""Job plumbing: what every job stands on (settings from the schema, GPU leases, compile caches,
hot-start proof, code dependencies, tracking, atomic outputs, errors); imports no stage code."""

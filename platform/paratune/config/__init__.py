"""What a run is configured by: the Plan, its degrees, devices, data, extras, the model's config; no torch."""

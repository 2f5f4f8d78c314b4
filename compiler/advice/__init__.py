"""Planning advice: `sw.recommend` weighs instance types and counts (recommend, recommend_report,
device_mix) and `sw.probe_accelerator` measures a device for the catalogue (probe, probe_model)."""

"""The IR: the typed data every pass, the simulator and the runtime share; it imports nothing else of stagewise."""

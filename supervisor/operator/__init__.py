"""The operator's tools shared by the CLI and the console: reads, replay and recovery jobs."""

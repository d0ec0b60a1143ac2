"""What runs inside each training process: the wrapper path, its background sampler, call sites,
completion tracking and the environment torch needs. It never imports the watchdog, exporters or reports."""

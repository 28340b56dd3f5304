"""XLA_FLAGS of the suite's processes: 8 fake CPU devices.

XLA:CPU ends a collective whose in-process participants have not all arrived within 40 s; on two
cores loaded by two test workers a device thread can be descheduled that long (seen with
distributed Muon's all-to-alls), so the fake devices wait 300 s before calling it a deadlock.
"""

FAKE_DEVICES = "--xla_force_host_platform_device_count=8 --xla_cpu_collective_call_terminate_timeout_seconds=300"

"""Pure algorithms shared by passes and backends: sequence packing and slot allocation."""

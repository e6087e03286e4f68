"""What both programs (the framework and the reference engine) agree on: request and
response structs (`io_struct`), URL paths, the flattened-bucket layout and dtype names
(`buckets`), weight-group setup (`weight_group`), tensor payloads and their allowlisting
unpickler (`tensor_payload`), version gates (`compat`), `WeightVersion`, and the flags
sglang and the routers accept, with how composed args render back to flags
(`flag_tables`)."""

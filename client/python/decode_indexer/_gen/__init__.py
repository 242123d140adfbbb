"""Generated Protobuf/gRPC modules of decode_indexer.v1 (see decode_indexer._generate)."""

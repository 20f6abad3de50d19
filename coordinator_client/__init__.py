"""The coordinator transport: a gRPC session that turns JobRequests into Jobs and Events into frames."""

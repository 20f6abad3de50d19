"""Generated from proto/provider/v1/provider.proto by tools/scripts/gen_proto.py; do not edit."""

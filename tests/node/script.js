// What the Node.js client scripts share: the service loaded from the .proto files alone (no generated code), the
// google.rpc.Status of a failed call decoded from its trailer, and a script's end: a failure, or its overall time
// passing, exits non-zero with a message naming the script.

"use strict";

const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const protobuf = require("protobufjs");

const PROTO_ROOT = path.resolve(__dirname, "..", "..", "proto");

function loadService() {
  const definition = protoLoader.loadSync(path.join(PROTO_ROOT, "disagg/fabric/v1/fabric_manager.proto"), {
    keepCase: true,
    enums: String,
    longs: String,
    defaults: true,
    oneofs: true,
    includeDirs: [PROTO_ROOT],
  });
  return grpc.loadPackageDefinition(definition).disagg.fabric.v1.FabricManagerService;
}

// The google.rpc messages of an error's details; the project's protos do not include them (rpc_status.proto).
const RPC = new protobuf.Root().loadSync(path.join(__dirname, "rpc_status.proto"), { keepCase: true });
const STATUS = RPC.lookupType("google.rpc.Status");

// The google.rpc.Status in a failed call's grpc-status-details-bin trailer: { code, message, details }, where
// details maps each detail's full type name (google.rpc.ErrorInfo, ...) to its fields; a type rpc_status.proto
// does not declare maps to null. Null when the trailer is missing.
function statusDetails(err) {
  const [bin] = err.metadata ? err.metadata.get("grpc-status-details-bin") : [];
  if (!bin) {
    return null;
  }
  const status = STATUS.decode(bin);
  const details = {};
  for (const any of status.details) {
    const name = any.type_url.slice(any.type_url.lastIndexOf("/") + 1);
    const type = RPC.lookup(name);
    details[name] = type instanceof protobuf.Type ? type.toObject(type.decode(any.value), { defaults: true }) : null;
  }
  return { code: status.code, message: status.message, details };
}

// Bounds the script `name` to `timeoutMs`; returns fail(message) and done() (call it once the summary is out).
function bounded(name, timeoutMs) {
  const overall = setTimeout(() => {
    process.stderr.write(`${name}: timed out after ${timeoutMs / 1000} s\n`);
    process.exit(3);
  }, timeoutMs);
  return {
    fail(message) {
      process.stderr.write(`${name}: ${message}\n`);
      process.exit(1);
    },
    done() {
      clearTimeout(overall);
    },
  };
}

module.exports = { bounded, loadService, statusDetails };

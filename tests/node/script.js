// What the Node.js client scripts share: the service loaded from the .proto files alone (no generated code), and
// a script's end: a failure, or its overall time passing, exits non-zero with a message naming the script.

"use strict";

const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

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

module.exports = { bounded, loadService };

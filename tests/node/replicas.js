#!/usr/bin/env node
// A Node.js client given every replica of the fabric manager (DISAGG_SERVERS, "ipv4:IP:PORT,IP:PORT") and the
// service config that docs/ha.md gives for it (DISAGG_SERVICE_CONFIG): make DISAGG_CALLS ListCompositions calls
// and report, for each, the names of the compositions listed or the error. One replica leads; the others are
// standbys, which answer every call UNAVAILABLE.
// Prints a JSON summary on stdout and exits 0; a failure to start, or 60 s passing, exits non-zero.

"use strict";

const grpc = require("@grpc/grpc-js");
const { bounded, loadService } = require("./script.js");

const CALL_TIMEOUT_MS = 10_000;
const { fail, done } = bounded("replicas", 60_000);

function listCompositions(client) {
  return new Promise((resolve) => {
    client.ListCompositions({}, { deadline: new Date(Date.now() + CALL_TIMEOUT_MS) }, (err, response) =>
      resolve(err ? { code: err.code, details: err.details } : { names: response.compositions.map((c) => c.name) }),
    );
  });
}

async function main() {
  const servers = process.env.DISAGG_SERVERS;
  const config = process.env.DISAGG_SERVICE_CONFIG;
  const calls = Number(process.env.DISAGG_CALLS || "8");
  if (!servers || !config) {
    fail("set DISAGG_SERVERS and DISAGG_SERVICE_CONFIG");
  }
  const Service = loadService();
  const client = new Service(servers, grpc.credentials.createInsecure(), { "grpc.service_config": config });
  const answers = [];
  for (let n = 0; n < calls; n += 1) {
    answers.push(await listCompositions(client));
  }
  client.close();
  done();
  process.stdout.write(`${JSON.stringify({ ok: true, answers })}\n`);
}

main().catch((err) => fail(err.stack || String(err)));

#!/usr/bin/env node
// A Node.js client of disagg.fabric.v1.FabricManagerService, from the .proto files alone (no generated code):
// list the compositions and watch the event log from the listing's revision, check that a Compose without a
// mode is INVALID_ARGUMENT and binds nothing, compose "gpu x2 model=H200" (always with a mode), get it, see it
// created and COMPOSED on the watch, decompose it and see it deleted, and check that an unknown composition is
// NOT_FOUND (not UNKNOWN) with the google.rpc.Status details docs/protocol.md promises (ErrorInfo, ResourceInfo),
// decoded from the grpc-status-details-bin trailer and reported for the caller to check.
// Prints a JSON summary on stdout and exits 0; any failure, or 60 s passing, exits non-zero.
//
//   DISAGG_SERVER=unix:/tmp/disagg.sock node tests/node/compose_watch_decompose.js

"use strict";

const crypto = require("node:crypto");
const grpc = require("@grpc/grpc-js");
const { bounded, loadService, statusDetails } = require("./script.js");

const CALL_TIMEOUT_MS = 15_000;
const { fail, done } = bounded("compose_watch_decompose", 60_000);

function deadline() {
  return new Date(Date.now() + CALL_TIMEOUT_MS);
}

// A unary call as a promise; a failed call rejects with the grpc-js error (code, details, metadata).
function unary(client, method, request) {
  return new Promise((resolve, reject) => {
    client[method](request, { deadline: deadline() }, (err, response) => (err ? reject(err) : resolve(response)));
  });
}

// Collects the events of a WatchEvents stream and lets the script wait for one that matches.
class Watch {
  constructor(client, afterRevision) {
    this.events = [];
    this.waiters = [];
    this.error = null;
    this.call = client.WatchEvents({ after_revision: afterRevision });
    this.call.on("data", (msg) => {
      this.events.push(msg.event);
      this.poll();
    });
    this.call.on("error", (err) => {
      if (err.code !== grpc.status.CANCELLED) {
        this.error = err;
      }
      this.poll();
    });
  }

  poll() {
    this.waiters = this.waiters.filter((w) => {
      const found = this.events.find(w.match);
      if (found) {
        clearTimeout(w.timer);
        w.resolve(found);
        return false;
      }
      if (this.error) {
        clearTimeout(w.timer);
        w.reject(new Error(`the watch failed: ${this.error.code} ${this.error.details}`));
        return false;
      }
      return true;
    });
  }

  waitFor(what, match) {
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        this.waiters = this.waiters.filter((w) => w.timer !== timer);
        reject(new Error(`no ${what} event within ${CALL_TIMEOUT_MS / 1000} s`));
      }, CALL_TIMEOUT_MS);
      this.waiters.push({ match, resolve, reject, timer });
      this.poll();
    });
  }

  cancel() {
    this.call.cancel();
  }
}

function check(condition, message) {
  if (!condition) {
    throw new Error(message);
  }
}

async function main() {
  const address = process.env.DISAGG_SERVER;
  if (!address) {
    fail("set DISAGG_SERVER to the fabric manager's address (unix:/path or 127.0.0.1:port)");
  }
  const Service = loadService();
  const client = new Service(address, grpc.credentials.createInsecure());
  await new Promise((resolve, reject) =>
    client.waitForReady(deadline(), (err) => (err ? reject(new Error(`cannot connect to ${address}: ${err.message}`)) : resolve())),
  );

  // List, then watch from the listing's revision: every change after the listing, none missed or repeated.
  const listed = await unary(client, "ListCompositions", {});
  check(/^[0-9]+$/.test(listed.revision), `ListCompositions answered no revision: ${JSON.stringify(listed)}`);
  const watch = new Watch(client, listed.revision);
  const name = `node-${process.pid}`;
  const request = {
    name,
    host: {},
    resources: [
      {
        kind: "DEVICE_KIND_GPU",
        count: 2,
        selectors: [{ key: "model", op: "SELECTOR_OP_EQ", value: { string_value: "H200" } }],
        affinity: "AFFINITY_NONE",
      },
    ],
    mode: "COMPOSE_MODE_APPLY",
    request_id: crypto.randomUUID(),
  };
  try {
    // A Compose that forgets its mode is refused, so that it never binds hardware by accident.
    const { mode, ...modeless } = request;
    let refused = null;
    try {
      await unary(client, "Compose", { ...modeless, request_id: crypto.randomUUID() });
    } catch (err) {
      refused = err;
    }
    check(refused !== null, "a Compose without a mode succeeded");
    check(
      refused.code === grpc.status.INVALID_ARGUMENT,
      `a Compose without a mode is code ${refused.code}, not INVALID_ARGUMENT: ${refused.details}`,
    );
    check(/mode/.test(refused.details), `the refusal does not name the mode: ${refused.details}`);
    const after = await unary(client, "ListCompositions", {});
    check(!after.compositions.some((c) => c.name === name), "a Compose without a mode composed something");

    check(mode === "COMPOSE_MODE_APPLY", `the request's mode is ${mode}`);
    const composed = await unary(client, "Compose", request);
    const comp = composed.composition;
    check(comp && comp.id, `Compose answered no composition: ${JSON.stringify(composed)}`);
    check(comp.name === name, `composed ${comp.name}, not ${name}`);
    check(comp.state === "COMPOSITION_STATE_COMPOSED", `the composition is ${comp.state}`);
    check(comp.devices.length === 2, `the composition has ${comp.devices.length} devices, not 2`);

    // The same request id again: the first answer, nothing bound twice.
    const again = await unary(client, "Compose", request);
    check(again.composition.id === comp.id, `a retried Compose made ${again.composition.id}, not ${comp.id}`);

    const got = (await unary(client, "GetComposition", { id: comp.id })).composition;
    check(got.id === comp.id && got.state === "COMPOSITION_STATE_COMPOSED", `GetComposition: ${JSON.stringify(got)}`);

    const created = await watch.waitFor(
      "COMPOSITION_CREATED",
      (e) => e.type === "EVENT_TYPE_COMPOSITION_CREATED" && e.subject === comp.id,
    );
    const composedEvent = await watch.waitFor(
      "COMPOSITION_STATE_CHANGED to COMPOSED",
      (e) => e.type === "EVENT_TYPE_COMPOSITION_STATE_CHANGED" && e.subject === comp.id && e.data.new === "COMPOSED",
    );
    check(BigInt(composedEvent.revision) > BigInt(created.revision), "COMPOSED came before COMPOSITION_CREATED");
    check(BigInt(created.revision) > BigInt(listed.revision), "the watch sent an event from before the listing");
    check(
      BigInt(watch.events[0].revision) === BigInt(listed.revision) + 1n,
      `the watch from ${listed.revision} began at ${watch.events[0].revision}`,
    );

    await unary(client, "Decompose", { id: comp.id });
    const deleted = await watch.waitFor(
      "COMPOSITION_DELETED",
      (e) => e.type === "EVENT_TYPE_COMPOSITION_DELETED" && e.subject === comp.id,
    );

    const unknownId = `no-such-composition-${process.pid}`;
    let notFound = null;
    try {
      await unary(client, "GetComposition", { id: unknownId });
    } catch (err) {
      notFound = err;
    }
    check(notFound !== null, "GetComposition of an unknown id succeeded");
    check(notFound.code !== grpc.status.UNKNOWN, `an unknown composition is UNKNOWN: ${notFound.details}`);
    check(notFound.code === grpc.status.NOT_FOUND, `an unknown composition is code ${notFound.code}, not NOT_FOUND`);
    const notFoundStatus = statusDetails(notFound);
    check(notFoundStatus !== null, "NOT_FOUND came without a grpc-status-details-bin trailer");
    check(notFoundStatus.code === notFound.code, `the trailer's code is ${notFoundStatus.code}, not ${notFound.code}`);
    const errorInfo = notFoundStatus.details["google.rpc.ErrorInfo"];
    const resourceInfo = notFoundStatus.details["google.rpc.ResourceInfo"];
    check(errorInfo, `NOT_FOUND has no ErrorInfo: ${JSON.stringify(notFoundStatus)}`);
    check(resourceInfo, `NOT_FOUND has no ResourceInfo: ${JSON.stringify(notFoundStatus)}`);

    const revisions = watch.events.map((e) => BigInt(e.revision));
    check(
      revisions.every((r, i) => i === 0 || r > revisions[i - 1]),
      `the watch's revisions are not increasing: ${revisions.join(",")}`,
    );
    const summary = {
      ok: true,
      address,
      composition: { id: comp.id, name: comp.name, host: comp.host, devices: comp.devices.map((d) => d.device) },
      retried_compose_same_composition: true,
      events: watch.events
        .filter((e) => e.subject === comp.id)
        .map((e) => ({ revision: e.revision, type: e.type, message: e.message })),
      revisions: {
        listed: listed.revision,
        first_watched: watch.events[0].revision,
        created: created.revision,
        composed: composedEvent.revision,
        deleted: deleted.revision,
      },
      unspecified_mode: { code: refused.code, details: refused.details },
      not_found: {
        code: notFound.code,
        name: "NOT_FOUND",
        details: notFound.details,
        asked: unknownId,
        status: {
          code: notFoundStatus.code,
          error_info: { domain: errorInfo.domain, reason: errorInfo.reason },
          resource_info: { resource_type: resourceInfo.resource_type, resource_name: resourceInfo.resource_name },
        },
      },
    };
    process.stdout.write(`${JSON.stringify(summary)}\n`);
  } finally {
    watch.cancel();
    client.close();
  }
}

main().then(
  () => {
    done();
    process.exit(0);
  },
  (err) => fail(err && err.message ? err.message : String(err)),
);

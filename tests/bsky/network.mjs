// Starts the Bluesky reference network (@atproto/dev-env: PLC, PDS, AppView,
// Ozone) for replyd's Bluesky tests and prints ONE JSON line on stdout when it
// is ready:
//
//   {"ready":true,"pds":"http://localhost:…","bsky":"http://localhost:…",
//    "plc":"http://localhost:…","appview_did":"did:plc:…","pds_did":"did:…",
//    "handle_domains":[".test",".example"],"startup_ms":…}
//
// It stops cleanly (network.close(), exit 0) on SIGTERM, SIGINT or when its
// stdin closes, so a test harness that dies cannot leave it running.
//
// Environment (as @atproto/dev-env expects):
//   DB_POSTGRES_URL     postgresql://root@127.0.0.1:5432/<a fresh database>  (required)
//   REDIS_HOST          127.0.0.1:6379                                       (required)
//   DB_POSTGRES_SCHEMA  optional schema suffix (default "replyd")
//
// Everything else goes to stderr: stdout carries only the JSON line.

import devEnv from '@atproto/dev-env'

const { TestNetwork } = devEnv

// dev-env and its services log to stdout in places; keep stdout for the JSON line.
const out = process.stdout.write.bind(process.stdout)
console.log = (...args) => console.error(...args)
console.info = (...args) => console.error(...args)

const fail = (msg) => {
  console.error(`network.mjs: ${msg}`)
  process.exit(2)
}

if (!process.env.DB_POSTGRES_URL) fail('DB_POSTGRES_URL is not set')
if (!process.env.REDIS_HOST) fail('REDIS_HOST is not set')

const started = Date.now()
let network
try {
  network = await TestNetwork.create({
    dbPostgresUrl: process.env.DB_POSTGRES_URL,
    dbPostgresSchema: process.env.DB_POSTGRES_SCHEMA || 'replyd',
  })
} catch (err) {
  fail(`could not start the network: ${err?.stack || err}`)
}

let closing = false
const shutdown = async (why) => {
  if (closing) return
  closing = true
  console.error(`network.mjs: stopping (${why})`)
  const force = setTimeout(() => process.exit(1), 15000)
  force.unref()
  try {
    await network.close()
  } catch (err) {
    console.error(`network.mjs: close failed: ${err?.stack || err}`)
    process.exit(1)
  }
  process.exit(0)
}

process.on('SIGTERM', () => shutdown('SIGTERM'))
process.on('SIGINT', () => shutdown('SIGINT'))
process.stdin.on('end', () => shutdown('stdin closed'))
process.stdin.on('error', () => shutdown('stdin error'))
process.stdin.resume()

out(
  JSON.stringify({
    ready: true,
    pds: network.pds.url,
    bsky: network.bsky.url,
    plc: network.plc.url,
    appview_did: network.bsky.serverDid,
    pds_did: network.pds.ctx.cfg.service.did,
    handle_domains: network.pds.ctx.cfg.identity.serviceHandleDomains,
    startup_ms: Date.now() - started,
  }) + '\n',
)

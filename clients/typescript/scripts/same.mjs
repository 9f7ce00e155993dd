// Fails when two files differ: the committed types against freshly generated ones.
import { readFileSync, rmSync } from "node:fs";

const [committed, fresh] = process.argv.slice(2);
const same = readFileSync(committed, "utf8") === readFileSync(fresh, "utf8");
rmSync(fresh);
if (!same) {
  console.error(`${committed} is out of date with openapi.json: run npm run generate and commit it`);
  process.exit(1);
}
console.log(`${committed} matches openapi.json`);

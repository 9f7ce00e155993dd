import type { ChildProcess } from "node:child_process";

export function freePort(): Promise<number>;
export function until<T>(what: string, ok: () => T | Promise<T>, ms?: number): Promise<NonNullable<T>>;

export class Processes {
  constructor(options: { python: string; cwd: string; env: NodeJS.ProcessEnv; stdin?: "ignore" | "pipe" });
  readonly python: string;
  readonly procs: ChildProcess[];
  readonly logs: string[];
  start(args: string[], env?: NodeJS.ProcessEnv): ChildProcess;
  tail(chars?: number): string;
  waitFor<T>(what: string, proc: ChildProcess | null, ok: () => Promise<T>, ms?: number): Promise<NonNullable<T>>;
  stopAll(): Promise<void>;
}

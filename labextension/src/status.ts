/**
 * One notebook kernel's GPU lease as its gpupool kernel tells it, over a comm
 * to target `gpupool.status` (docs/api.md, "The status comm"). The kernel
 * pushes `{state}` on every change and `{event}` for what happens between
 * cells, and answers `{request}` with `{reply}`; nothing here polls.
 */
import { Notification } from '@jupyterlab/apputils';
import { Kernel, KernelMessage } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';

export const TARGET = 'gpupool.status';

/** What the kernel says the lease is (gpupool.magics.events.lease_state). */
export interface ILeaseState {
  phase: 'detached' | 'queued' | 'starting' | 'attached' | 'parked';
  lease: string | null;
  share: string | null;
  fraction: number | null;
  gpu_count: number | null;
  gpu_model: string | null;
  gpu_indices: number[] | null;
  node: string | null;
  node_state: string | null;
  memory_used: number | null;
  memory_limit: number | null;
  idle_timeout: number | null;
  idle_deadline: string | null;
  idle_warning: number | null;
  on_idle: 'park' | 'release' | null;
  queue_position: number | null;
  eta: number | null;
  reason: string | null;
}

/** The kernel's answer to one request. */
export interface IReply {
  reply: string | null;
  id?: string;
  ok: boolean;
  message: string;
  output?: string;
  defaults?: IDefaults;
  /** `status`: the one lease `%gpu status` lists, its cells by column name; null: none or several. */
  details?: { [column: string]: string } | null;
}

/** What the Acquire dialog starts from (gpupool.magics.events.Requests.defaults). */
export interface IDefaults {
  amount: string;
  max_idle_timeout: number | null;
  max_lease_gpus: number | null;
  models: string[];
  error?: string;
}

/** How each event kind is shown (none: the status bar says it). */
const NOTIFY: { [kind: string]: Notification.TypeOptions } = {
  idle_warning: 'warning',
  parked: 'info',
  resumed: 'success',
  node_lost: 'error',
  node_back: 'success',
  ended: 'warning',
  admitted: 'info',
  refused: 'error'
};

/** The lease channel of one kernel; dispose when the kernel goes. */
export class LeaseChannel {
  constructor(kernel: Kernel.IKernelConnection) {
    this.kernel = kernel;
    this._comm = kernel.createComm(TARGET);
    this._comm.onMsg = msg => this._onMsg(msg);
    this._comm.onClose = () => {
      this._closed = true;
    };
    this._comm.open({});
  }

  readonly kernel: Kernel.IKernelConnection;

  /** The last state the kernel sent; null until it sends one (not a gpupool kernel). */
  get state(): ILeaseState | null {
    return this._state;
  }

  /** Emitted with each new state. */
  get stateChanged(): ISignal<this, ILeaseState> {
    return this._stateChanged;
  }

  get isDisposed(): boolean {
    return this._closed;
  }

  /** Send `{request: kind, ...extra}` and resolve with the kernel's reply. */
  request(kind: string, extra: { [key: string]: any } = {}): Promise<IReply> {
    if (this._closed) {
      return Promise.resolve({
        reply: kind,
        ok: false,
        message: 'the kernel is gone; restart it or open the notebook again'
      });
    }
    const id = `r${++this._count}`;
    return new Promise<IReply>(resolve => {
      this._pending.set(id, resolve);
      if (kind === 'acquire') {
        this._quiet += 1; // the dialog shows a refusal itself
      }
      this._comm.send({ request: kind, id, ...extra });
    });
  }

  /** The user is at this notebook (focused it, moved to a cell, typed): start a parked lease's
   * resume now, so that the next cell finds it (almost) ready. Once per park. */
  resumeIfParked(): void {
    if (this._state?.phase === 'parked' && !this._resumeAsked && !this._closed) {
      this._resumeAsked = true;
      void this.request('resume');
    }
  }

  dispose(): void {
    if (!this._closed) {
      this._closed = true;
      try {
        this._comm.close();
      } catch (err) {
        // the kernel connection is already gone
      }
    }
    this._pending.forEach(resolve =>
      resolve({ reply: null, ok: false, message: 'the kernel went away' })
    );
    this._pending.clear();
  }

  private _onMsg(msg: KernelMessage.ICommMsgMsg): void {
    const data = msg.content.data as any;
    if (data.state) {
      this._state = data.state as ILeaseState;
      if (this._state.phase !== 'parked') {
        this._resumeAsked = false;
      }
      if (this._state.phase !== 'attached' || !this._state.idle_deadline) {
        this._dismissWarning(); // parked, detached, or a cell runs: the idle warning is stale
      }
      this._stateChanged.emit(this._state);
    } else if (data.event) {
      this._event(String(data.event), String(data.message || ''));
    } else if ('reply' in data) {
      const resolve = this._pending.get(data.id);
      if (resolve) {
        this._pending.delete(data.id);
        if (data.reply === 'acquire') {
          this._quiet = Math.max(0, this._quiet - 1);
        }
        resolve(data as IReply);
      }
    }
  }

  private _event(kind: string, message: string): void {
    const type = NOTIFY[kind];
    if (!type || (kind === 'refused' && this._quiet > 0)) {
      return;
    }
    this._dismissWarning(); // one notification of the lease's idleness at a time, never a stale one
    const id = Notification.emit(`GPU: ${message}`, type, {
      autoClose: type === 'error' || kind === 'idle_warning' ? false : 8000
    });
    if (kind === 'idle_warning') {
      this._warning = id;
    }
  }

  private _dismissWarning(): void {
    if (this._warning !== null) {
      Notification.dismiss(this._warning);
      this._warning = null;
    }
  }

  private _comm: Kernel.IComm;
  private _state: ILeaseState | null = null;
  private _stateChanged = new Signal<this, ILeaseState>(this);
  private _pending = new Map<string, (reply: IReply) => void>();
  private _count = 0;
  private _quiet = 0;
  private _closed = false;
  private _warning: string | null = null; // the open idle warning's notification id
  private _resumeAsked = false; // resumeIfParked asked during this park
}

/** `1.5 GiB` for bytes. */
export function formatBytes(bytes: number | null): string {
  if (bytes === null || bytes === undefined) {
    return '?';
  }
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${value.toFixed(unit === 0 ? 0 : 1)} ${units[unit]}`;
}

/** `1m 05s` for seconds. */
export function formatSeconds(seconds: number): string {
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) {
    return `${s}s`;
  }
  if (s < 3600) {
    return `${Math.floor(s / 60)}m ${String(s % 60).padStart(2, '0')}s`;
  }
  return `${Math.floor(s / 3600)}h ${String(Math.floor((s % 3600) / 60)).padStart(2, '0')}m`;
}

/** Seconds until the idle deadline, or null while a cell runs / none known. */
export function idleLeft(state: ILeaseState, now: number = Date.now()): number | null {
  if (state.phase !== 'attached' || !state.idle_deadline) {
    return null;
  }
  return (Date.parse(state.idle_deadline) - now) / 1000;
}

/** The status bar's words for `state`. */
export function summary(state: ILeaseState, now: number = Date.now()): string {
  switch (state.phase) {
    case 'detached':
      return 'GPU: detached';
    case 'queued': {
      let text = 'GPU: queued';
      if (state.queue_position) {
        text += ` #${state.queue_position}`;
      }
      if (state.eta !== null && state.eta !== undefined) {
        text += `, about ${formatSeconds(state.eta)}`;
      }
      return text;
    }
    case 'starting':
      return `GPU: starting${state.node ? ' on ' + state.node : ''}`;
    case 'parked':
      return `GPU: parked (${state.share}); the next cell resumes`;
    case 'attached': {
      const model = state.gpu_model || 'GPU';
      const share =
        state.gpu_count === 1 ? `${(state.fraction || 0).toFixed(2)} of ${model}` : `${state.gpu_count} × ${model}`;
      let text = `GPU: ${share} on ${state.node}`;
      text += ` · ${state.memory_used !== null ? formatBytes(state.memory_used) + ' / ' : ''}${formatBytes(
        state.memory_limit
      )}`;
      const left = idleLeft(state, now);
      if (left !== null) {
        text += ` · idle, ${state.on_idle === 'release' ? 'released' : 'parked'} in ${formatSeconds(left)}`;
      }
      return text;
    }
  }
  return 'GPU: ?';
}

/**
 * One notebook kernel's GPU lease as its gpupool kernel tells it, over a comm
 * to target `gpupool.status` (docs/api.md, "The status comm"). The kernel
 * pushes `{state}` on every change and `{event}` for what happens between
 * cells, and answers `{request}` with `{reply}`; nothing here polls.
 */
import { Dialog, Notification, showDialog } from '@jupyterlab/apputils';
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
  preempt_at: string | null;
  moving_from: string | null;
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
  /** `status`: the names holding GPU memory on the worker, as `%gpu status` lists them; null: no worker runs. */
  holders?: { columns?: string[]; rows?: string[][]; notes?: string[] } | null;
}

/** What the Acquire dialog starts from (gpupool.magics.events.Requests.defaults). */
export interface IDefaults {
  amount: string;
  max_idle_timeout: number | null;
  max_lease_gpus: number | null;
  models: string[];
  error?: string;
}

/** Whether the toast of event `kind` no longer says what is true once the lease is in `state`. */
export function stale(kind: string, state: ILeaseState): boolean {
  switch (kind) {
    case 'idle_warning':
      return state.phase !== 'attached' || !state.idle_deadline; // parked, detached, or a cell runs
    case 'parked':
      return state.phase !== 'parked';
    case 'node_lost':
      return state.phase === 'detached' || state.node_state === 'up';
    case 'refused':
    case 'admitted':
      return state.phase === 'attached' || state.phase === 'parked';
    default:
      return state.phase === 'detached' && kind !== 'ended';
  }
}

/** How each event kind is shown (none: the status bar says it). */
const NOTIFY: { [kind: string]: Notification.TypeOptions } = {
  idle_warning: 'warning',
  parked: 'info',
  resumed: 'success',
  node_lost: 'error',
  node_back: 'success',
  service_down: 'error',
  service_back: 'success',
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

  /** Emitted when the lease enters `attached` or `detached` from another phase: a worker came or went,
   * so which widgets are alive may have changed. */
  get workerChanged(): ISignal<this, void> {
    return this._workerChanged;
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
    this._dismiss(); // the kernel is gone: what its toast said is over
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
      const before = this._state?.phase;
      this._state = data.state as ILeaseState;
      if (this._state.phase !== 'parked') {
        this._resumeAsked = false;
      }
      if (this._toast && stale(this._toast.kind, this._state)) {
        this._dismiss();
      }
      this._stateChanged.emit(this._state);
      if (this._state.phase !== before && ['attached', 'detached'].includes(this._state.phase)) {
        this._workerChanged.emit();
      }
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

  /** Show `message` as this lease's notification of `kind` (what the kernel's events do), for what a request
   * did that no cell shows: an acquire from the dialog ('attached'). */
  tell(kind: string, message: string, type: Notification.TypeOptions): void {
    this._toastOf(kind, message, type);
  }

  private _event(kind: string, message: string): void {
    const type = NOTIFY[kind];
    if (!type || (kind === 'refused' && this._quiet > 0)) {
      return;
    }
    this._toastOf(kind, message, type);
  }

  private _toastOf(kind: string, message: string, type: Notification.TypeOptions): void {
    // One toast per kernel's lease, updated in place: each event replaces what the last one said.
    const autoClose = type === 'error' || kind === 'idle_warning' ? false : 8000;
    const full = `GPU: ${message}`;
    const text = shorten(full);
    // JupyterLab cuts a toast at 140 characters: the rest is one click away, whole.
    const actions =
      text === full
        ? []
        : [
            {
              label: 'Details',
              callback: () =>
                void showDialog({ title: 'GPU', body: full, buttons: [Dialog.okButton({ label: 'Close' })] })
            }
          ];
    if (this._toast && Notification.update({ id: this._toast.id, message: text, type, autoClose, actions })) {
      this._toast.kind = kind;
      return;
    }
    this._toast = { id: Notification.emit(text, type, { autoClose, actions }), kind };
  }

  private _dismiss(): void {
    if (this._toast !== null) {
      Notification.dismiss(this._toast.id);
      this._toast = null;
    }
  }

  private _comm: Kernel.IComm;
  private _state: ILeaseState | null = null;
  private _stateChanged = new Signal<this, ILeaseState>(this);
  private _workerChanged = new Signal<this, void>(this);
  private _pending = new Map<string, (reply: IReply) => void>();
  private _count = 0;
  private _quiet = 0;
  private _closed = false;
  private _toast: { id: string; kind: string } | null = null; // this lease's one notification, and what it says
  private _resumeAsked = false; // resumeIfParked asked during this park
}

/**
 * What `%gpu acquire` said of the lease it attached (a request's `output`), as one notification: from its
 * `gpupool: attached L-…` line on (not the progress before it), each line without `gpupool: `, as sentences.
 */
export function attachedWords(output: string): string {
  const lines = output
    .split('\n')
    .map(line => line.replace(/^gpupool: /, '').trim())
    .filter(line => line);
  const first = lines.findIndex(line => line.startsWith('attached '));
  return lines
    .slice(Math.max(first, 0))
    .map((line, i) => (i === 0 ? line : line.charAt(0).toUpperCase() + line.slice(1)))
    .join(' ');
}

/** The lease's GPU memory limit: `80.0 GiB`, or `2 × 80.0 GiB` on several GPUs (as `%gpu status` says it). */
export function formatLimit(state: ILeaseState): string {
  const count = state.gpu_count || 1;
  if (count > 1 && state.memory_limit !== null) {
    return `${count} × ${formatBytes(state.memory_limit / count)}`;
  }
  return formatBytes(state.memory_limit);
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

/** Seconds until the pool parks a preemptible lease whose GPU a waiting person needs (`preempt_at`), or null. */
export function preemptLeft(state: ILeaseState, now: number = Date.now()): number | null {
  if (state.phase !== 'attached' || !state.preempt_at) {
    return null;
  }
  return (Date.parse(state.preempt_at) - now) / 1000;
}

/** The coming preemption in the kernel's `preempt_notice` words (gpupool.magics.heartbeat.preempt_words), with
 * the time left now; null when none comes. */
export function preemptWords(state: ILeaseState, now: number = Date.now()): string | null {
  const left = preemptLeft(state, now);
  if (left === null) {
    return null;
  }
  return (
    `lease ${state.lease} is preemptible and ${state.reason || 'others are waiting for a GPU'}: in about ` +
    `${formatSeconds(left)} it is parked, the running cell frozen where it is (or interrupted where the node ` +
    'cannot freeze a running cell); it goes on when the pool resumes the lease'
  );
}

/** Whether the notebook's lease can be released from here: one the kernel holds, attached or parked (a parked
 * lease's resume waiting for room reads `parked` too, with its place in line); a new request that is queued or
 * starting is not the kernel's to release yet (interrupting its cell gives it up). */
export function releasable(state: ILeaseState | null): boolean {
  return !!state && (state.phase === 'attached' || state.phase === 'parked');
}

/** Whether a parked lease's resume waits in line for room: its variables come home only after it. */
export function resumeWaits(state: ILeaseState | null): boolean {
  return !!state && state.phase === 'parked' && state.queue_position !== null && state.queue_position !== undefined;
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
    case 'parked': {
      if (state.moving_from) {
        return `GPU: moving (${state.share}) from ${state.moving_from} to ${state.node}`;
      }
      if (resumeWaits(state)) {
        const eta = state.eta !== null && state.eta !== undefined ? `, about ${formatSeconds(state.eta)}` : '';
        return `GPU: parked (${state.share}); resume waiting for room #${state.queue_position}${eta}`;
      }
      return `GPU: parked (${state.share}); a click, a key or a cell here resumes it`;
    }
    case 'attached': {
      const model = state.gpu_model || 'GPU';
      const share =
        state.gpu_count === 1 ? `${(state.fraction || 0).toFixed(2)} of ${model}` : `${state.gpu_count} × ${model}`;
      let text = `GPU: ${share} on ${state.node}`;
      text += ` · ${state.memory_used !== null ? formatBytes(state.memory_used) + ' / ' : ''}${formatLimit(state)}`;
      if (state.node_state && state.node_state !== 'up') {
        return `${text} · node ${state.node_state}`; // its cells may not answer: no countdown to show
      }
      const preempt = preemptLeft(state, now);
      if (preempt !== null) {
        return `${text} · preempted ${preempt > 0 ? 'in ' + formatSeconds(preempt) : 'now'}`; // a cell runs: no idle countdown
      }
      const left = idleLeft(state, now);
      if (left !== null) {
        text += ` · idle, ${state.on_idle === 'release' ? 'released' : 'parked'} in ${formatSeconds(left)}`;
      }
      return text;
    }
  }
  return 'GPU: ?';
}

/** The longest toast JupyterLab shows whole (its Notification truncates the message there). */
const TOAST_LIMIT = 140;

/**
 * ``text`` as a toast shows it: whole when it fits, else cut at the last clause (``; `` or ``: ``)
 * that fits, with an ellipsis.
 */
export function shorten(text: string): string {
  if (text.length <= TOAST_LIMIT) {
    return text;
  }
  const room = text.slice(0, TOAST_LIMIT - 2);
  const cut = Math.max(room.lastIndexOf('; '), room.lastIndexOf(': '));
  return `${cut > 40 ? room.slice(0, cut) : room.slice(0, room.lastIndexOf(' '))} …`;
}

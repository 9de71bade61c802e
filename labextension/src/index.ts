/**
 * gpupool in JupyterLab: the current notebook's GPU lease in the status bar,
 * "Acquire GPU…", "Release GPU" and "GPU status" in the palette and the Kernel
 * menu, and the lease's events as notifications. All of it comes from the
 * notebook's own gpupool kernel (./status.ts); the `%gpu` magics stay the
 * reference interface, and work the same without this extension.
 */
import {
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { Dialog, ICommandPalette, showDialog } from '@jupyterlab/apputils';
import { IMainMenu } from '@jupyterlab/mainmenu';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { Kernel, KernelSpec } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';
import { IStatusBar } from '@jupyterlab/statusbar';
import { Widget } from '@lumino/widgets';

import {
  IDefaults,
  ILeaseState,
  IReply,
  LeaseChannel,
  attachedWords,
  formatBytes,
  formatLimit,
  formatSeconds,
  idleLeft,
  preemptLeft,
  preemptWords,
  releasable,
  resumeWaits,
  summary
} from './status';
import { liveWidgetComms, markDeadWidgets } from './widgets';

const CMD = {
  acquire: 'gpupool:acquire',
  release: 'gpupool:release',
  status: 'gpupool:status'
};

/** Whether a kernelspec is gpupool's (its provisioner; `gpupool kernelspec install` writes it). */
function isGpupool(spec: KernelSpec.ISpecModel | undefined): boolean {
  const provisioner = (spec?.metadata as any)?.kernel_provisioner;
  return !!provisioner && provisioner.provisioner_name === 'gpupool';
}

/** The lease channel of each notebook panel's current kernel (gpupool kernels only). */
class Channels {
  constructor(tracker: INotebookTracker) {
    this._tracker = tracker;
  }

  /** Emitted when a kernel's spec has been read (a channel may exist now). */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** The current notebook's channel, opening one for its kernel when needed. */
  current(): LeaseChannel | null {
    const panel = this._tracker.currentWidget;
    return panel ? this.of(panel) : null;
  }

  of(panel: NotebookPanel): LeaseChannel | null {
    const kernel = panel.sessionContext.session?.kernel;
    if (!kernel) {
      return null;
    }
    // One comm per kernel process: a kernel that refused it (not a gpupool kernel)
    // is not asked again until it restarts (_watch forgets it then).
    let channel = this._byKernel.get(kernel.id);
    if (!channel) {
      const known = this._gpupool.get(kernel.id);
      if (known === undefined) {
        this._gpupool.set(kernel.id, false);
        void kernel.spec.then(spec => {
          this._gpupool.set(kernel.id, isGpupool(spec));
          this._changed.emit();
        });
        return null;
      }
      if (!known) {
        return null; // another kernel: no comm, no status item
      }
      channel = new LeaseChannel(kernel);
      channel.workerChanged.connect(() => void this._markWidgets(kernel));
      this._byKernel.set(kernel.id, channel);
      this._watch(kernel);
    }
    return channel;
  }

  /** Mark the widgets of `kernel`'s notebooks whose worker ended (./widgets.ts). */
  private async _markWidgets(kernel: Kernel.IKernelConnection): Promise<void> {
    const live = await liveWidgetComms(kernel).catch(() => null);
    if (live) {
      this._tracker.forEach(panel => {
        if (panel.sessionContext.session?.kernel?.id === kernel.id) {
          markDeadWidgets(panel, live);
        }
      });
    }
  }

  private _watch(kernel: Kernel.IKernelConnection): void {
    kernel.statusChanged.connect((_, status) => {
      if (status === 'restarting' || status === 'autorestarting' || status === 'dead') {
        this._byKernel.get(kernel.id)?.dispose();
        this._byKernel.delete(kernel.id);
      }
    });
    kernel.disposed.connect(() => {
      this._byKernel.get(kernel.id)?.dispose();
      this._byKernel.delete(kernel.id);
    });
  }

  private _tracker: INotebookTracker;
  private _byKernel = new Map<string, LeaseChannel>();
  private _gpupool = new Map<string, boolean>();
  private _changed = new Signal<this, void>(this);
}

/** The status-bar item: the lease in words, a countdown while idle; click for details. */
class LeaseItem extends Widget {
  constructor(onClick: () => void) {
    super();
    // JupyterLab's own text-item look (font, 24px line): a bare div sat a few pixels above its neighbours.
    this.addClass('jp-StatusBar-TextItem');
    this.addClass('jp-gpupool-status');
    this.node.title = LeaseItem.TITLE;
    this.node.addEventListener('click', onClick);
    this._timer = window.setInterval(() => this.render(), 1000);
  }

  follow(channel: LeaseChannel | null): void {
    if (channel === this._channel) {
      return;
    }
    this._channel?.stateChanged.disconnect(this._changed, this);
    this._channel = channel;
    channel?.stateChanged.connect(this._changed, this);
    this.render();
  }

  render(): void {
    const state = this._channel?.state;
    this.node.textContent = state ? summary(state) : '';
    this.node.dataset.phase = state ? state.phase : 'none';
    // A coming preemption: the notice's words as the tooltip, until the park or its withdrawal clears preempt_at.
    const preempt = state ? preemptWords(state) : null;
    this.node.title = preempt ? `GPU: ${preempt} (click for details)` : LeaseItem.TITLE;
    this.node.classList.toggle('jp-gpupool-preempted', preempt !== null);
    this.setHidden(!state);
  }

  static readonly TITLE = 'GPU lease of this notebook (click for details)';

  dispose(): void {
    window.clearInterval(this._timer);
    super.dispose();
  }

  private _changed(): void {
    this.render();
  }

  private _channel: LeaseChannel | null = null;
  private _timer: number;
}

/** The facts of a state as rows (the same as `%gpu status` says). */
function facts(state: ILeaseState): [string, string][] {
  const rows: [string, string][] = [['state', state.phase]];
  const add = (name: string, value: any) => {
    if (value !== null && value !== undefined && value !== '') {
      rows.push([name, String(value)]);
    }
  };
  add('lease', state.lease);
  add('share', state.share);
  add('GPU', state.gpu_model && `${state.gpu_model} (GPU ${(state.gpu_indices || []).join(', ')})`);
  add('node', state.node && `${state.node}${state.node_state && state.node_state !== 'up' ? ' (' + state.node_state + ')' : ''}`);
  if (state.memory_limit !== null) {
    add('memory', `${state.memory_used !== null ? formatBytes(state.memory_used) + ' used of ' : ''}${formatLimit(state)}`);
  }
  add('idle timeout', state.idle_timeout !== null ? formatSeconds(state.idle_timeout) : null);
  const left = idleLeft(state);
  add(state.on_idle === 'release' ? 'released if idle in' : 'parked if idle in', left !== null ? formatSeconds(left) : null);
  const preempt = preemptLeft(state);
  add('preempted in', preempt !== null ? formatSeconds(preempt) : null);
  add(state.phase === 'parked' ? 'resume in line' : 'place in queue', state.queue_position);
  add('wait', state.eta !== null ? `about ${formatSeconds(state.eta)}` : null);
  add('why', state.reason);
  return rows;
}

/** `%gpu status` columns that the state's facts already say (each fact is shown once). */
const SAID = new Set(['lease', 'state', 'node', 'GPU', 'share', 'memory used / limit', 'idle deadline in / reason']);

/** The popup's one table: the state's facts, then what only `%gpu status` knows (environment, class,
 * host, GPU utilization, worker); without a lease to detail, the kernel's one line of words. */
function detailsBody(state: ILeaseState, reply: IReply): Widget {
  const body = new Widget();
  body.addClass('jp-gpupool-details');
  const rows = facts(state);
  for (const [name, value] of Object.entries(reply.details || {})) {
    if (!SAID.has(name) && value && value !== '-') {
      rows.push([name, value]);
    }
  }
  const table = document.createElement('table');
  for (const [name, value] of rows) {
    const row = table.insertRow();
    row.insertCell().textContent = name;
    row.insertCell().textContent = value;
  }
  body.node.appendChild(table);
  if (reply.holders) {
    body.node.appendChild(holdersTable(reply.holders));
  }
  if (!reply.details && reply.message && !reply.message.includes('\n')) {
    const words = document.createElement('p');
    words.textContent = reply.message;
    body.node.appendChild(words);
  }
  return body;
}

/** What holds GPU memory on the worker (`%gpu status`'s second table), or the words saying none or why not. */
function holdersTable(holders: NonNullable<IReply['holders']>): HTMLElement {
  const part = document.createElement('div');
  part.className = 'jp-gpupool-holders';
  const rows = holders.rows || [];
  if (rows.length) {
    const table = document.createElement('table');
    const head = table.createTHead().insertRow();
    for (const name of holders.columns || []) {
      const cell = document.createElement('th');
      cell.textContent = name;
      head.appendChild(cell);
    }
    for (const cells of rows) {
      const row = table.insertRow();
      for (const value of cells) {
        row.insertCell().textContent = value;
      }
    }
    part.appendChild(table);
  }
  const notes = holders.notes?.length ? holders.notes : rows.length ? [] : ['no names hold GPU memory on the worker'];
  for (const note of notes) {
    const words = document.createElement('p');
    words.textContent = note;
    part.appendChild(words);
  }
  return part;
}

/** The Acquire dialog's form; `text()` is what follows `%gpu acquire`. */
class AcquireForm extends Widget {
  constructor(defaults: IDefaults | undefined) {
    super();
    this.addClass('jp-gpupool-acquire');
    const field = (name: string, label: string, hint: string, value = '') => {
      const row = document.createElement('label');
      row.textContent = label;
      const input = document.createElement('input');
      input.name = name;
      input.value = value;
      input.placeholder = hint;
      row.appendChild(input);
      this.node.appendChild(row);
      return input;
    };
    this.amount = field('amount', 'Share or count', '0.5 of one GPU, or 2 whole GPUs', defaults?.amount || '0.5');
    this.memory = field('memory', 'Memory', "e.g. 20GiB (default: the share's)");
    const models = defaults?.models || [];
    this.model = field('model', 'Model', models.length ? `any; the pool has ${models.join(', ')}` : 'any');
    const limit = defaults?.max_idle_timeout;
    this.idle = field('idle-timeout', 'Idle timeout', `e.g. 30m${limit ? '; at most ' + formatSeconds(limit) : ''} (default: the pool's)`);
    this.error = document.createElement('div');
    this.error.className = 'jp-gpupool-error';
    this.node.appendChild(this.error);
  }

  text(): string {
    const parts = [this.amount.value.trim()];
    const add = (flag: string, input: HTMLInputElement) => {
      const value = input.value.trim();
      if (value) {
        parts.push(flag, value.includes(' ') ? JSON.stringify(value) : value);
      }
    };
    add('--memory', this.memory);
    add('--model', this.model);
    add('--idle-timeout', this.idle);
    return parts.join(' ');
  }

  say(words: string): void {
    this.error.textContent = words;
  }

  readonly amount: HTMLInputElement;
  readonly memory: HTMLInputElement;
  readonly model: HTMLInputElement;
  readonly idle: HTMLInputElement;
  readonly error: HTMLDivElement;
}

/** A dialog that stays open with the kernel's words when the acquire is refused. */
class AcquireDialog extends Dialog<string> {
  constructor(channel: LeaseChannel, form: AcquireForm) {
    super({
      title: 'Acquire GPU',
      body: form,
      buttons: [Dialog.cancelButton(), Dialog.okButton({ label: 'Acquire' })],
      focusNodeSelector: 'input'
    });
    this._channel = channel;
    this._form = form;
  }

  resolve(index?: number): void {
    const accept = index === undefined ? true : index === 1;
    if (!accept || this._done) {
      super.resolve(index);
      return;
    }
    if (this._busy) {
      return;
    }
    this._busy = true;
    this.addClass('jp-gpupool-busy');
    this._form.say('acquiring…');
    void this._channel.request('acquire', { text: this._form.text() }).then(reply => {
      this._busy = false;
      this.removeClass('jp-gpupool-busy');
      if (reply.ok) {
        this._done = true;
        super.resolve(index);
        // No cell shows what the magic said: its words come as the lease's notification, folder included.
        this._channel.tell('attached', attachedWords(reply.output || reply.message), 'success');
      } else {
        this._form.say(reply.message);
      }
    });
  }

  private _channel: LeaseChannel;
  private _form: AcquireForm;
  private _busy = false;
  private _done = false;
}

function noKernel(): void {
  void showDialog({
    title: 'GPU',
    body: 'The current notebook has no gpupool kernel: pick "Python 3 (gpupool)" as its kernel (or use %gpu in the notebook).',
    buttons: [Dialog.okButton()]
  });
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'gpupool-lab:plugin',
  description: 'The notebook GPU lease of gpupool: status bar, commands and notifications.',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [IStatusBar, ICommandPalette, IMainMenu],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    statusBar: IStatusBar | null,
    palette: ICommandPalette | null,
    mainMenu: IMainMenu | null
  ) => {
    const channels = new Channels(tracker);
    const ready = (): LeaseChannel | null => {
      const channel = channels.current();
      return channel && channel.state ? channel : null;
    };

    app.commands.addCommand(CMD.acquire, {
      label: 'Acquire GPU…',
      caption: 'Attach a share of a pooled GPU to this notebook (%gpu acquire)',
      isEnabled: () => !!ready() && ready()!.state!.phase === 'detached',
      execute: async () => {
        const channel = ready();
        if (!channel) {
          return noKernel();
        }
        const defaults = await channel.request('defaults');
        await new AcquireDialog(channel, new AcquireForm(defaults.defaults)).launch();
      }
    });
    app.commands.addCommand(CMD.release, {
      label: 'Release GPU',
      caption: "Give this notebook's GPU back; its variables come here (%gpu release)",
      isEnabled: () => releasable(ready()?.state ?? null),
      execute: async () => {
        const channel = ready();
        if (!channel) {
          return noKernel();
        }
        const state = channel.state!;
        let discard = false;
        if (resumeWaits(state)) {
          // Its variables are frozen with its worker and come home only after the resume, which waits for room:
          // giving it up now is a release without them (the kernel answers a plain release so, at once).
          const busy = channel.kernel.status === 'busy';
          const choice = await showDialog({
            title: 'Release GPU',
            body:
              `${state.lease} is parked and its resume waits for room (place ${state.queue_position} in line` +
              `${state.eta !== null ? ', about ' + formatSeconds(state.eta) : ''}). Its variables are frozen with ` +
              `its worker on ${state.node || 'its node'} and come home only after the resume: releasing it now ` +
              `discards them${busy ? ', and interrupts the cell waiting for it' : ''}. To keep them, run ` +
              '%gpu release in a cell: it waits for the resume.',
            defaultButton: 0,
            buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Release without variables' })]
          });
          if (!choice.button.accept) {
            return;
          }
          if (busy) {
            await channel.kernel.interrupt(); // a cell waiting for the resume holds the kernel until room comes
          }
          discard = true;
        }
        const reply = await channel.request('release', discard ? { discard: true } : {});
        if (!reply.ok) {
          await showDialog({ title: 'Release GPU', body: reply.message, buttons: [Dialog.okButton()] });
        }
      }
    });
    app.commands.addCommand(CMD.status, {
      label: 'GPU status',
      caption: "This notebook's GPU lease (%gpu status)",
      execute: async () => {
        const channel = ready();
        if (!channel) {
          return noKernel();
        }
        const reply = await channel.request('status');
        const state = channel.state!;
        const attached = releasable(state);
        const result = await showDialog({
          title: 'GPU status',
          body: detailsBody(state, reply),
          defaultButton: 0, // Close: Enter must not release the lease
          buttons: [
            Dialog.cancelButton({ label: 'Close' }),
            attached
              ? Dialog.warnButton({ label: 'Release' })
              : Dialog.okButton({ label: 'Acquire…' })
          ]
        });
        if (result.button.accept) {
          await app.commands.execute(attached ? CMD.release : CMD.acquire);
        }
      }
    });

    for (const command of Object.values(CMD)) {
      palette?.addItem({ command, category: 'GPU' });
    }
    mainMenu?.kernelMenu.addGroup(
      Object.values(CMD).map(command => ({ command })),
      100
    );

    if (statusBar) {
      const item = new LeaseItem(() => void app.commands.execute(CMD.status));
      const follow = () => {
        item.follow(channels.current());
        app.commands.notifyCommandChanged();
      };
      tracker.currentChanged.connect(follow);
      channels.changed.connect(follow);
      tracker.widgetAdded.connect((_, panel) => {
        panel.sessionContext.kernelChanged.connect(follow);
        panel.sessionContext.statusChanged.connect(follow);
        // Resume a parked lease as soon as the user is back at its notebook (docs/parking.md).
        const back = () => channels.of(panel)?.resumeIfParked();
        panel.content.activeCellChanged.connect(back);
        panel.node.addEventListener('keydown', back);
        panel.node.addEventListener('focusin', back);
      });
      statusBar.registerStatusItem('gpupool-lab:status', {
        item,
        align: 'left',
        rank: 4,
        isActive: () => !!tracker.currentWidget && tracker.currentWidget === app.shell.currentWidget
      });
      follow();
    }
  }
};

export default plugin;
